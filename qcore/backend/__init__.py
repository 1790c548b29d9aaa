"""The backend contract (protocol), plugin registry, the reference backend, ops and input rules of products."""
