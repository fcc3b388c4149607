"""The absl apps (the only place that defines flags)."""
