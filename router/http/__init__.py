"""The router's HTTP server: one server for every endpoint, with one route table and one set of
edge rules (docs/router.md, "HTTP"). :mod:`router.http.edges` has the rules, :mod:`router.http.wire`
the bytes of a reply, :mod:`router.http.server` the connections, :mod:`router.http.routes` the
table."""
