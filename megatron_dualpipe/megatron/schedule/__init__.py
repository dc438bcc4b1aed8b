"""Schedule room: registry, plan, stages, forward-backward; imports model/ grads/ compat/."""
