"""OpenTelemetry for every process: setup, attribute names, metrics, spans, OTLP JSON files,
and the request and job tracing the frontend and runner call."""
