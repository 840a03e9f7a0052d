"""Planning: the plan's types and rules, the pure planner and re-planner, and the task that decides
when to plan (docs/architecture.md, "The scheduler's rooms")."""
