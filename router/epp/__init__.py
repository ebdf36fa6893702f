"""The router behind Envoy's external processing protocol: kvroute as the Gateway API Inference
Extension's endpoint picker (``kvroute epp``; docs/kubernetes.md). The gateway proxies the bytes;
the picker reads the request, makes the HTTP router's decision, names the chosen worker in the
``x-gateway-destination-endpoint`` header and the ``envoy.lb`` metadata, and follows the reply to
close the request's booking. Its rooms: ``wire`` (the ext_proc messages), ``exchange`` (one
request's stream), ``server`` (the gRPC server beside the router's HTTP one)."""
