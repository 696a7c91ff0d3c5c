"""mooncaked.cluster"""
