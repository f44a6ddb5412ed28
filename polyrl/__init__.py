"""polyrl: composable RL post-training for LLMs."""
