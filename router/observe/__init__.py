"""What an operator reads: the metrics (``metrics``), the dashboard (``dashboard``, its page in
``static/``) and the OpenAPI document (``openapi``)."""
