"""mooncaked.transfer"""
