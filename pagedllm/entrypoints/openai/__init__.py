"""The OpenAI-compatible server; `api_server.py` lists the modules and what each holds."""
