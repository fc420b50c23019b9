"""The agent: one per node. Spawns, watches and stops the node's workers; carries out commands."""
