"""mooncaked.store"""
