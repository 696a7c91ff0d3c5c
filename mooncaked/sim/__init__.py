"""mooncaked.sim"""
