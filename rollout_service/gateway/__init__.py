"""The HTTP gateway: the Flask app, its routes, the OpenAPI document, /metrics and the viewer."""
