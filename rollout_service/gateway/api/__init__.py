"""HTTP routes by area; each route is declared once (api/common.py) for Flask and /openapi.json."""
