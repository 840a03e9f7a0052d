"""`nexus simulate`: a discrete-event simulation of a serving cluster on a virtual clock."""
