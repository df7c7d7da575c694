"""The server runtime the gateway, the worker and the config service share: the HTTP front's
helpers, logs, telemetry, NATS names and stream declarations, the typed messages between
processes (protocol), the config follower, the pool store and the model config schema. The
bottom of the server's import graph: it imports neither the services nor the command, and the
client (``heron_sdk``) never imports it."""
