"""The OpenAI-compatible HTTP API's wire format: request and response structs with their checks,
and error responses. Shared by the node's front (daemon/api/) and the conductor
(federation/conductor/)."""
