"""datastore"""
