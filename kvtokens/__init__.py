"""A model's tokenizer and chat template (:mod:`kvtokens.tokenizer`), below every other package:
the router tokenizes prompts with it and the simulated engine answers ``/tokenize`` with it, so
both count the same tokens. It imports nothing from the project."""
