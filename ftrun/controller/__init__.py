"""The controller: one per job, inside the agent that hosts the store."""
