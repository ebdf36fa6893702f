"""A request's prompt: its body read (``body``, ``id_memo``), its tokens (``tokenization``,
``token_memo``, ``token_cache``; the tokenizer itself is :mod:`kvtokens`), its block hashes
(``hashing``)."""
