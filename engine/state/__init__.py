"""The fleet service's state in one SQLite database (:mod:`engine.state.db`): the only module that
speaks SQL. :mod:`engine.state.legacy` imports a state dir's JSON files from before it, once."""
