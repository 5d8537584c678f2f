"""OpenAI Responses: request models, input items -> chat turn, routes and answer/stream shaping."""
