"""Jacobi Forcing: trajectories, noise-schedule data, masks, forward, losses, the objective and
the tiny-jf recipe.
"""
