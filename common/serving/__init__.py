"""Serving plumbing both services share: the grpc.aio server, TLS, auth, telemetry."""
