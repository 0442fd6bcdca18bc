"""`mira serve`: an OpenAI-compatible HTTP server over one model (pip install mira[serve])."""
