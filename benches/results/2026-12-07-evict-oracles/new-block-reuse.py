# P(a new block is used again later) by how much of its request was seen before (k: leading blocks seen
# earlier in the trace) and the uses of the last seen block. Usage: python3 new-block-reuse.py TRACE
import json, sys
from collections import Counter, defaultdict
reqs=[json.loads(l)['hash_ids'] for l in open(sys.argv[1])]
uses=Counter(); later=Counter()
for r in reqs:
    for b in r: later[b]+=1
tot=defaultdict(lambda:[0,0])
for r in reqs:
    k=0
    while k<len(r) and uses[r[k]]>0: k+=1
    # the deepest seen block's uses (the last block of the seen prefix)
    key=('k=0' if k==0 else 'k<=2' if k<=2 else 'k<=8' if k<=8 else 'k>8', min(uses[r[k-1]],4) if k else 0)
    for j,b in enumerate(r):
        later[b]-=1
        if uses[b]==0:
            tot[key][0]+=1; tot[key][1]+= later[b]>0
        uses[b]+=1
for k in sorted(tot): print(k,'new blocks',tot[k][0],'P(reused later) %.3f'%(tot[k][1]/tot[k][0]))
