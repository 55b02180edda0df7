"""What every serving runtime's ring stands on: the coordinator's two ends of a ring of stage workers."""
