"""mooncaked.engine"""
