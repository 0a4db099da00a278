"""What the entry points share: provenance, the results schema, the workload generator and trace
reader, the checks of files and folders, and the settings every entry point's own section uses.
It imports no entry point."""
