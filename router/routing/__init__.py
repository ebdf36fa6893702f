"""The decision: the alive workers (``fleet``, ``allow``), the index lookup within its budget
(``lookups``), the cost learned online (``ttft``, ``ttft_fit``) and shared with the other replicas
(``model_sync``), pure scoring (``scoring``), one decision (``decide``), a request's load
lifecycle (``booking``), when workers were last busy (``activity``), and how a decision did
(``accounting``: predicted against reported cached tokens, the lost tokens' split)."""
