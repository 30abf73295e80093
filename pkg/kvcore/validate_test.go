package kvcore

import ()
