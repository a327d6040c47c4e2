"""What the addon did, for operators: Prometheus metrics and OpenTelemetry
traces, read off what the other capabilities already put on each flow."""
