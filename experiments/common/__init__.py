"""What the entry points share: provenance, the results schema, the workload generator and trace
reader, and the checks of files and folders.
It imports no entry point."""
