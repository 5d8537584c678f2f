"""OpenAI chat/completions: request models, routes and answer shaping."""
