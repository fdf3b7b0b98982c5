"""One router per resource: instances (operators), engines (engine-facing), health."""
