"""Which stages go where: the placement planner and its MILP."""
