"""Where the optimizer state lives: the bucket layout (:mod:`.layout`), the storage formats (:mod:`.codecs`), the
places bytes live (:mod:`.tiers`), a rule's buffers allocated from its declarations (:mod:`.store`), the
masters and parameter binding (:mod:`.params`), and the entries ``opt.state`` shows (:mod:`.views`)."""
