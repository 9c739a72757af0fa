"""A user's project as a test sees it: its own models, data sets, losses and metrics,
named to distsgd by import path (``tests.user_project.zoo:...``)."""
