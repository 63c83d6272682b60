"""A whole federation on this machine: processes, the demo, reports from histories."""
