"""The operators' dashboard: an overview page and a live metrics page fed over a WebSocket."""
