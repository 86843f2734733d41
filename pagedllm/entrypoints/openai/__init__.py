"""The OpenAI-compatible server; `routes.py` lists the modules and what each holds."""
