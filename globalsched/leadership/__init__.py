"""Which of several schedulers acts: the database lease, or a Kubernetes Lease fenced by it."""
