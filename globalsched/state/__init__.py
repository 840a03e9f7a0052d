"""What the scheduler knows: members and their liveness, the model and query databases, profiles in
service, rate reports, and the frozen view the planner reads (docs/architecture.md, "The scheduler's
rooms")."""
