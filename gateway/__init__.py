"""Heron gateway: stateless HTTP edge that routes work through NATS JetStream."""
