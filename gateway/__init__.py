"""kvgate's gateway: the OpenAI HTTP API, config, plugins and routing. Never imports torch."""

__version__ = "0.1.0"
