"""The router's side towards the workers: the connection pool (``pool``), one connection's
HTTP/1.1 exchange (``http1``), forwarding a request and relaying its reply (``proxy``), the
reply's usage read as it passes (``usage``)."""
