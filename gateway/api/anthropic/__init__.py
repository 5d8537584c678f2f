"""Anthropic Messages: request models, the request -> chat turn mapping, routes and answer/stream shaping."""
