"""Scale planning: profiles of measured costs, a discrete-event simulation of the loop, and the layout planner."""
