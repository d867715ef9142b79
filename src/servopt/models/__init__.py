"""Model sources: every way a user hands servopt a model (see ``sources``)."""
