"""mooncaked.conductor"""
