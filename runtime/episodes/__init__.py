"""Multi-turn episodes: tool calls in each family's format, the loop that alternates the
generator's turns with environment steps, and what an episode trains on (the model's tokens
only, each with the version that sampled it)."""
