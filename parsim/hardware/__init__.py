"""The hardware: cluster files, a cluster placed on its nodes (links, routes), and the flow-level network."""
