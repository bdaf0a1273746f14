"""The step-width policy: what runs at each batch size. The built-in policy, width plans (their
schema, the mode that follows one, its run-time check and candidate watch) and lookup draft
lengths.
"""
