"""Objectives and losses: the SFT loss and its token weighting (losses), the preference objectives (preference) and the step strategy that runs them with their reference model (preference_step)."""
